"""`python -m rlkernel.backends.cpu`: build the CPU kernels now (make install does), check, report."""
import json
import logging
import sys

from . import status

logging.basicConfig(level=logging.INFO)
st = status()
print(json.dumps(st, indent=1))
sys.exit(0 if st["cpu_kernels"] else 1)
