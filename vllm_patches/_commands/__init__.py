"""One module per verb of ``vllm-patches``: ``run(args)`` does the verb and returns its
exit code. ``_cli`` parses the command line and imports only the verb's module."""
