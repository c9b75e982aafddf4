"""The command's entry point (`vllm-patches`, `python -m vllm_patches`). Its first
statement holds SIGINT and SIGTERM back until the verb knows its checkout
(``_interrupt``): a signal while the modules load ends in the same one line."""

import signal

signal.pthread_sigmask(signal.SIG_BLOCK, (signal.SIGINT, signal.SIGTERM))

import sys

from vllm_patches._cli import main

if __name__ == "__main__":
    sys.exit(main())
