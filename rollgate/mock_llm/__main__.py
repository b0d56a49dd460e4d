"""`python -m rollgate.mock_llm`: the mock LLM until interrupted."""

import sys

from rollgate.mock_llm.cli import main

sys.exit(main())
