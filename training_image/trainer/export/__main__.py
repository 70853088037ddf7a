"""`python -m trainer.export` (the export job's entrypoint): trainer.export.hf_folder.main."""

import sys

from trainer.export.hf_folder import main

if __name__ == "__main__":
    sys.exit(main())
