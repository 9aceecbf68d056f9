"""`python -m tsengine.train --recipe ...` is `train/train_eagle3.py --recipe ...`."""

import sys

from tsengine.train.train_eagle3 import main

sys.exit(main())
