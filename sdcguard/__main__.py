import sys

from sdcguard.cli import main

sys.exit(main())
