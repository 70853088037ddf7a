"""`python -m trainstack.emulator`: the local AWS emulator in the foreground (trainstack.emulator.server)."""

from trainstack.emulator.server import main

main()
