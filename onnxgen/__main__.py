import sys

from onnxgen.cli import main

if __name__ == "__main__":  # an engine process (spawned) imports this module again under another name
    sys.exit(main())
