"""The datasets: :class:`IDXDataset` (one split, loaded into memory), :class:`MNIST`,
:class:`FashionMNIST` and their files' checksums."""

import warnings

import numpy as np

from .download import _FileInfo, _cached_file_ok, _check_mirror, _download, data_root, offline_hint
from .idx import _check_pair, _idx_size, read_idx
from .loader import DataLoader


class IDXDataset:
    """One split of an MNIST-like dataset, loaded into memory.

    Subclasses only fill in the class attributes below; ``MNIST`` and
    ``FashionMNIST`` are the two provided.

    Attributes of an instance:
        images  uint8 array (N, 28, 28), pixel values 0..255
        labels  int32 array (N,), values in [0, len(classes))
        train   True for the training split, False for the test split
        folder  the cache folder holding the decompressed IDX files
    """

    name = ""                 # the cache subfolder, e.g. "mnist"
    classes = []              # class names, indexed by label
    mean = 0.0                # mean and std of the training pixels scaled to [0, 1],
    std = 1.0                 #   for normalisation: x = (pixel / 255 - mean) / std
    default_mirrors = ()      # base URLs, tried in order
    splits = {}               # "train"/"test" -> (images file, labels file)
    files = {}                # file name -> _FileInfo
    cli_name = None           # its --dataset value in python -m cydnn.train (None: the default)

    def __init__(self, root=None, train=True, download=True, mirrors=None):
        self.train = bool(train)
        self.root = data_root(root)
        self.folder = self.root / self.name
        self.mirrors = [_check_mirror(m) for m in (self.default_mirrors if mirrors is None else mirrors)]

        images_name, labels_name = self.splits["train" if self.train else "test"]
        images_path = self._ensure(images_name, download)
        labels_path = self._ensure(labels_name, download)

        self.images = read_idx(images_path)
        self.labels = read_idx(labels_path).astype(np.int32)
        _check_pair(self.images, self.labels, len(self.classes), what=f"{type(self).__name__} {images_name}")

    def _ensure(self, filename, download):
        """Path of a verified cached IDX file, downloading it if needed (and allowed)."""
        path = self.folder / filename
        info = self.files[filename]
        if path.exists():
            if _cached_file_ok(path, info):
                return path
            path.unlink()
            warnings.warn(f"{path} failed its SHA-256 check and was removed"
                          + ("; downloading it again" if download else ""), stacklevel=3)
        if not download:
            raise FileNotFoundError(
                f"{type(self).__name__}: {filename} is not in {self.folder}. "
                f"Pass download=True to fetch it (mirrors: {', '.join(map(str, self.mirrors))}), "
                f"or point root= or $CYDNN_DATA at the folder that holds {self.name}/{filename}.")
        names = sorted({n for pair in self.splits.values() for n in pair})
        gz = ", ".join(f"{n}.gz" for n in names)
        hint = offline_hint(self.cli_name, self.folder, f"{gz} (or the same files decompressed: the checksums "
                                                        f"of both are known)", gz)
        _download(type(self).__name__, filename, info, self.folder, self.mirrors,
                  strict=set(self.default_mirrors), hint=hint)
        return path

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        """``(image, label)``: a (28, 28) uint8 array and an int."""
        return self.images[i], int(self.labels[i])

    def __repr__(self):
        split = "train" if self.train else "test"
        return f"{type(self).__name__}({split}, {len(self)} samples, folder='{self.folder}')"

    def loader(self, batch_size=128, shuffle=None, **kwargs):
        """A :class:`DataLoader` over this split, normalised with the class's mean and std.

        ``shuffle`` defaults to True for the training split and False for the test split;
        other keyword arguments go to :class:`DataLoader`.
        """
        kwargs.setdefault("mean", self.mean)
        kwargs.setdefault("std", self.std)
        kwargs.setdefault("num_classes", len(self.classes))
        return DataLoader(self.images, self.labels, batch_size=batch_size,
                          shuffle=self.train if shuffle is None else shuffle, **kwargs)


_MNIST_SPLITS = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}


class MNIST(IDXDataset):
    """The MNIST handwritten digits (LeCun, Cortes, Burges): 60,000 train / 10,000 test.

    ``MNIST(root=None, train=True, download=True, mirrors=None)``: ``root`` is the
    cache root (see :func:`data_root`); ``mirrors`` replaces ``default_mirrors``
    and may hold http(s) URLs, ``file://`` URLs or local directory paths.
    """

    name = "mnist"
    classes = ["0", "1", "2", "3", "4", "5", "6", "7", "8", "9"]
    mean = 0.1307
    std = 0.3081
    default_mirrors = (
        "https://ossci-datasets.s3.amazonaws.com/mnist/",
        "https://storage.googleapis.com/cvdf-datasets/mnist/",
    )
    splits = _MNIST_SPLITS
    files = {
        "train-images-idx3-ubyte": _FileInfo(
            _idx_size(60000, 28, 28),
            "ba891046e6505d7aadcbbe25680a0738ad16aec93bde7f9b65e87a2fc25776db",
            9912422, "440fcabf73cc546fa21475e81ea370265605f56be210a4024d2ca8f203523609"),
        "train-labels-idx1-ubyte": _FileInfo(
            _idx_size(60000),
            "65a50cbbf4e906d70832878ad85ccda5333a97f0f4c3dd2ef09a8a9eef7101c5",
            28881, "3552534a0a558bbed6aed32b30c495cca23d567ec52cac8be1a0730e8010255c"),
        "t10k-images-idx3-ubyte": _FileInfo(
            _idx_size(10000, 28, 28),
            "0fa7898d509279e482958e8ce81c8e77db3f2f8254e26661ceb7762c4d494ce7",
            1648877, "8d422c7b0a1c1c79245a5bcf07fe86e33eeafee792b84584aec276f5a2dbc4e6"),
        "t10k-labels-idx1-ubyte": _FileInfo(
            _idx_size(10000),
            "ff7bcfd416de33731a308c3f266cc351222c34898ecbeaf847f06e48f7ec33f2",
            4542, "f7ae60f92e00ec6debd23a6088c31dbd2371eca3ffa0defaefb259924204aec6"),
    }


class FashionMNIST(IDXDataset):
    """Zalando's Fashion-MNIST: 28x28 grey images of 10 kinds of clothing, same format as MNIST.

    Zalando publishes only MD5 sums of its .gz files (README of zalandoresearch/fashion-mnist,
    the same in torchvision): from the default mirrors, both the .gz's MD5 and the SHA-256 of
    the decompressed file must match; from a mirror you name, the SHA-256 of the content.
    """

    name = "fashion-mnist"
    cli_name = "fashion-mnist"
    classes = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
               "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"]
    mean = 0.2860
    std = 0.3530
    default_mirrors = (
        "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",
        "https://github.com/zalandoresearch/fashion-mnist/raw/master/data/fashion/",
    )
    splits = _MNIST_SPLITS
    files = {
        "train-images-idx3-ubyte": _FileInfo(
            _idx_size(60000, 28, 28),
            "c59f468a2f672dc815687fe0f83887768d799fd8a3f3276145d20f83aa44d888",
            gz_md5="8d4fb7e6c68d591d4c3dfef9ec88bf0d"),
        "train-labels-idx1-ubyte": _FileInfo(
            _idx_size(60000),
            "bad3541b69d912435c50bb6ba87bec294ff4f6a2e1246121d8633921760443d9",
            gz_md5="25c81989df183df01b3e8a0aad5dffbe"),
        "t10k-images-idx3-ubyte": _FileInfo(
            _idx_size(10000, 28, 28),
            "5b4141f0afbad91edebe8549f8fcffe087ea10ca49f1dbef5c9a5cd8815ce37b",
            gz_md5="bef4ecab320f06d8554ea6380940ec79"),
        "t10k-labels-idx1-ubyte": _FileInfo(
            _idx_size(10000),
            "0402a96d92fd2663957122ceb108a494c5af83dab82d92729df917d7dec38c34",
            gz_md5="bb300cfdad3c16e7a12a480ee83cd310"),
    }


def load_mnist(root=None, mirrors=None, download=True):
    """``(train, test)``: both splits of MNIST."""
    return (MNIST(root, train=True, download=download, mirrors=mirrors),
            MNIST(root, train=False, download=download, mirrors=mirrors))


def load_fashion_mnist(root=None, mirrors=None, download=True):
    """``(train, test)``: both splits of Fashion-MNIST."""
    return (FashionMNIST(root, train=True, download=download, mirrors=mirrors),
            FashionMNIST(root, train=False, download=download, mirrors=mirrors))
