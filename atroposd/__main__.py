import sys

from atroposd.cli import main

sys.exit(main())
