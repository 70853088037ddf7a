"""`python -m trainer.prepare` (the processing job's entrypoint): trainer.prepare.pipeline.main (with
`--format chat`, trainer.prepare.chat_prepare.main), its
every failure written to the job's /opt/ml/output/message (ExitMessage) with its class
(trainer.runtime.failure)."""

import sys

from trainer.prepare.pipeline import main
from trainer.runtime.failure import run_reporting
from trainstack.protocol.exit_codes import MESSAGE_FILE

if __name__ == "__main__":
    # `--format chat`: conversations through a base model's chat template (trainer.prepare.chat_prepare),
    # imported only then: the text path's spawned pool workers import this module, and need none of it.
    args, entry = sys.argv[1:], main
    if "--format=chat" in args or any(
        a == "--format" and b == "chat" for a, b in zip(args, args[1:], strict=False)
    ):
        from trainer.prepare.chat_prepare import main as entry
    sys.exit(run_reporting(entry, MESSAGE_FILE))
