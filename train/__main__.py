"""`python -m train --recipe ...` is `train/train_eagle3.py --recipe ...`."""

import sys

from train.train_eagle3 import main

sys.exit(main())
