"""The SeDAX broker process: the asyncio layer around the sans-IO overlay (see docs/architecture.md)."""

import os

# numpy's and scipy's OpenBLAS each start one thread per core when they are loaded, and after every call those
# threads spin for a while before they sleep.  A broker's numbers (Delaunay neighbourhoods, load vectors) are
# far too small for a BLAS thread pool: on a 2-core machine the spinning only takes a core from the brokers
# and clients beside it, and each idle broker carries two threads for nothing.  Set here, before any broker
# module imports numpy (through overlay), so it holds however the broker is started; a setting of the user's
# own stands.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
