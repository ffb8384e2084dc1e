import sys

from weightszip.cli import main

sys.exit(main())
