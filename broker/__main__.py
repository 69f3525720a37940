"""`python -m broker`: run one SeDAX broker process."""

import sys

from broker.main import main

sys.exit(main())
