import sys

from stepwatch.app._cli import main

sys.exit(main())
