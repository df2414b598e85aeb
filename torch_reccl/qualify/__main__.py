import sys

from torch_reccl.qualify.cli import main

sys.exit(main())
