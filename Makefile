# epcc: `make demo` (the main job) and `make test`. See README.md.

VENV  := .venv
PY    := $(VENV)/bin/python
EPCC  := $(VENV)/bin/epcc
SCHED := schedules/ubbv2_ep32.sched
OUT   := build/ubbv2_ep32

.PHONY: setup demo test clean

setup:
	bash scripts/setup.sh

# Set up, compile the example schedule, render its DAG, simulate it.
demo: setup
	@mkdir -p build
	$(EPCC) compile $(SCHED) -o $(OUT)
	$(EPCC) viz $(SCHED) -o $(OUT).svg
	$(EPCC) simulate $(SCHED)
	@echo "produced:"
	@for p in $(OUT) $(OUT).svg; do if [ -e "$$p" ]; then echo "  $$p"; fi; done

# Python tests, then the native (CTest) tests; fails if either fails.
test: setup
	$(PY) -m pytest -q tests
	ctest --test-dir build/native --output-on-failure

clean:
	rm -rf build
