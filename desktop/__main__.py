import sys

from desktop.app import main

sys.exit(main())
