"""Datasets: MNIST, Fashion-MNIST, CIFAR-10 and a user's own images; download, verify, parse, and
serve in batches.

One module per part, each usable alone:

1. **Files and checksums** (``mnist.py``, ``cifar.py``, with the dataset classes).  MNIST and
   Fashion-MNIST are four gzip-compressed IDX files each; for each file we know the SHA-256 of
   its decompressed contents and what is published for the ``.gz`` (MNIST: size and SHA-256;
   Fashion-MNIST: MD5).  CIFAR-10 is one binary archive of known size, SHA-256 and MD5.

2. **Download and cache** (``download.py``, with ``transfer.py`` for the bytes and
   ``errors.py``).  A missing file is fetched from each mirror in turn until one gives bytes
   that pass verification; a file only ever gets its final name after it was verified
   (a temporary in the same folder, then ``os.replace``, which is atomic).

3. **Parsing** (``idx.py``, ``npz.py``, ``cifar.py``, ``folder.py``): bounded by the sizes the
   files declare, checked before anything is allocated; errors name the file and the entry.

4. **A user's data** (``arrays.py``, ``folder.py``): :class:`ArrayDataset`, :func:`from_npz`,
   :class:`ImageFolder`.

5. **Batches** (``loader.py``).  :class:`DataLoader` shuffles, and builds each batch with ONE
   backend op (``gather_batch`` for grey images, ``gather_batch_chw`` for colour ones: random
   crop and flip), so the same loop runs on the CPU (numpy) and on the GPU.

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
from .arrays import ArrayDataset, from_npz
from .cifar import CIFAR10, load_cifar10
from .download import data_root
from .errors import DatasetCacheError, DatasetDownloadError, DatasetError
from .folder import ImageFolder
from .idx import read_idx
from .loader import DataLoader
from .mnist import MNIST, FashionMNIST, IDXDataset, load_fashion_mnist, load_mnist

__all__ = [
    "ArrayDataset",
    "CIFAR10",
    "DataLoader",
    "DatasetCacheError",
    "DatasetDownloadError",
    "DatasetError",
    "FashionMNIST",
    "IDXDataset",
    "ImageFolder",
    "MNIST",
    "data_root",
    "from_npz",
    "load_cifar10",
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

#: Largest member of a user's .npz (``from_npz``), uncompressed, in bytes: a larger declared
#: size is refused before anything is read.
MAX_NPZ_MEMBER_BYTES = 4 << 30

#: Largest image ``ImageFolder`` decodes, in pixels (width x height from the file's header).
MAX_IMAGE_PIXELS = 1 << 26

