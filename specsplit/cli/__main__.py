import sys

from specsplit.cli import main

sys.exit(main())
