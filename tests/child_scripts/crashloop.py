"""Exits at once with the code in argv[1] (default 1), after a line on stderr."""

import sys

code = int(sys.argv[1]) if len(sys.argv) > 1 else 1
print(f"crashloop: exiting with {code}", file=sys.stderr, flush=True)
sys.exit(code)
