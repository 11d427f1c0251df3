import sys

from stepwatch._cli import main

sys.exit(main())
