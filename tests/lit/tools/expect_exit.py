"""`expect_exit.py N CMD [ARGS...]`: run CMD (its output passed through) and exit 0 if its exit
status is N; otherwise say what it was and exit 1.  Used by the lit tests as `%expect-exit 1`."""

import subprocess
import sys


def main(argv: list[str]) -> int:
    if len(argv) < 2 or not argv[0].lstrip("-").isdigit():
        print("usage: expect_exit.py STATUS CMD [ARGS...]", file=sys.stderr)
        return 2
    want = int(argv[0])
    try:
        got = subprocess.run(argv[1:]).returncode
    except OSError as e:
        print(f"expect_exit.py: cannot run {argv[1]}: {e}", file=sys.stderr)
        return 1
    if got != want:
        print(f"expect_exit.py: {argv[1]} exited with status {got}, expected {want}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
