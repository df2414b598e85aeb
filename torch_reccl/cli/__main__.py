import sys

from torch_reccl.cli import main

sys.exit(main())
