import sys

from .present.cli import main

sys.exit(main())
