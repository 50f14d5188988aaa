import sys

from sparkchat.cli import main

sys.exit(main())
