import sys

from vllm_patches._cli import main

sys.exit(main())
