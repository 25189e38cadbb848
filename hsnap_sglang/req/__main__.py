"""``python -m hsnap_sglang.req --docs [docs/sglang.md]``: write the field table into the docs."""

import os
import sys

from .fields import write_docs

if sys.argv[1:2] == ["--docs"]:
    write_docs(sys.argv[2] if len(sys.argv) > 2 else os.path.join(os.path.dirname(__file__), "..", "..", "docs", "sglang.md"))
