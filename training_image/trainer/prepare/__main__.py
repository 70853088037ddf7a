"""`python -m trainer.prepare` (the processing job's entrypoint): trainer.prepare.pipeline.main, its
every failure written to the job's /opt/ml/output/message (ExitMessage) with its class
(trainer.runtime.failure)."""

import sys

from trainer.prepare import chat_prepare
from trainer.prepare.pipeline import main
from trainer.runtime.failure import run_reporting
from trainstack.protocol.exit_codes import MESSAGE_FILE

if __name__ == "__main__":
    # `--format chat`: conversations through a base model's chat template (trainer.prepare.chat_prepare).
    sys.exit(run_reporting(chat_prepare.main if chat_prepare.is_chat(sys.argv[1:]) else main, MESSAGE_FILE))
