# Runs `PYTHON -m pytest -q TESTS_DIR -k SELECT`; used by the CTest test ir_verify.
# pytest's exit code 5 (no tests collected, or all deselected by -k) counts as
# a pass, so the test is robust before the selected tests exist.
#
#   cmake -DPYTHON=... -DTESTS_DIR=... -DSELECT=... -P run_pytest.cmake
foreach(var PYTHON TESTS_DIR SELECT)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "run_pytest.cmake: -D${var}=... is required")
  endif()
endforeach()

execute_process(
  COMMAND ${PYTHON} -m pytest -q ${TESTS_DIR} -k ${SELECT}
  RESULT_VARIABLE rc)

if(rc EQUAL 5)
  message("run_pytest: pytest collected no tests matching -k ${SELECT} (exit 5); counted as a pass")
elseif(NOT rc EQUAL 0)
  message(FATAL_ERROR "run_pytest: pytest -k ${SELECT} failed (exit ${rc})")
endif()
