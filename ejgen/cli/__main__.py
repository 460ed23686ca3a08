"""`python -m ejgen.cli`: the ejgen command."""

import sys

from ejgen.cli import main

sys.exit(main())
