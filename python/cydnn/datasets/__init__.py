"""MNIST and Fashion-MNIST: download, verify, parse, and serve in batches.

The package has four parts, one module each, each usable alone:

1. **Files and checksums** (``mnist.py``, with the dataset classes).  Both
   datasets are four gzip-compressed IDX files.  For each file we know the SHA-256 of its decompressed contents (and, for
   MNIST, the size and SHA-256 of the ``.gz`` the public mirrors serve).

2. **Download and cache** (``download.py``).  A missing file is fetched as
   ``<mirror>/<name>.gz`` from each mirror in turn until one gives bytes that pass verification.
   The cache keeps the *decompressed* IDX file under
   ``<root>/<dataset-name>/<name>``, so a later load reads no gzip.  A file only
   ever gets its final name after it was verified (written to a temporary
   file in the same folder, then moved with ``os.replace``, which is atomic).

3. **IDX parsing** (``idx.py``).  :func:`read_idx` turns IDX bytes into a
   numpy array and explains exactly what is wrong when the bytes are not a valid IDX file.

4. **Batches** (``loader.py``).  :class:`DataLoader` shuffles, and builds
   each batch with ONE backend op, ``ops.gather_batch``, so the same loop runs on the CPU (numpy)
   and on the GPU (the whole dataset uploaded once).

Typical use::

    from cydnn.datasets import MNIST, DataLoader

    train = MNIST(train=True)              # downloads once into ./data/mnist/
    loader = DataLoader(train.images, train.labels, batch_size=128,
                        mean=MNIST.mean, std=MNIST.std, device="cuda")
    for x, y in loader:                    # x: (B, 1, 28, 28) float32, y: (B,) int32
        ...

The limits below are read when they are used, so assigning to them (``cydnn.datasets.TIMEOUT =
5``) takes effect at once.
"""
from .download import data_root
from .errors import DatasetCacheError, DatasetDownloadError, DatasetError
from .idx import read_idx
from .loader import DataLoader
from .mnist import MNIST, FashionMNIST, IDXDataset, load_fashion_mnist, load_mnist

__all__ = [
    "DataLoader",
    "DatasetCacheError",
    "DatasetDownloadError",
    "DatasetError",
    "FashionMNIST",
    "IDXDataset",
    "MNIST",
    "data_root",
    "load_fashion_mnist",
    "load_mnist",
    "read_idx",
]

#: Seconds to wait for a mirror to connect, and then between two chunks of data.
TIMEOUT = 30

#: Seconds one whole file may take to download from one mirror (a server that
#: trickles a byte a second never trips TIMEOUT, but trips this; curl's --max-time).
DOWNLOAD_DEADLINE = 600

#: Minimum rate of a download, in bytes/s, averaged over the last MIN_RATE_SECONDS
#: (curl's --speed-limit and --speed-time): a slower mirror is abandoned for the next
#: one.  0 turns the check off.
MIN_DOWNLOAD_RATE = 1024
MIN_RATE_SECONDS = 30

#: Largest IDX file accepted, in bytes (a header that declares more is refused
#: before anything is allocated; MNIST's largest file is 47 MB).
MAX_IDX_BYTES = 1 << 30

#: Seconds to wait for another process that is filling the same cache file.
LOCK_TIMEOUT = 900

