import sys

from onnxgen.cli import main

sys.exit(main())
