"""LeNet-5 in PyTorch with cydnn's layer names (conv1, conv2, fc1, fc2, fc3).

Shared by ``make_interop_fixtures.py`` and ``pytorch_roundtrip.py``; needs
torch.  ``TorchLeNet5(classic=False)`` is cydnn's modern LeNet-5 (28 x 28
input, ReLU, max pooling, flatten 256); ``classic=True`` is the 1998 one
(32 x 32 input, tanh, average pooling, flatten 400).  The state_dict keys and
shapes are exactly those of ``cydnn.models.LeNet5``.
"""
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


class TorchLeNet5(nn.Module):
    def __init__(self, classic=False, num_classes=10):
        super().__init__()
        self.classic = classic
        self.conv1 = nn.Conv2d(1, 6, 5)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5 if classic else 16 * 4 * 4, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, num_classes)

    @property
    def input_size(self):
        return 32 if self.classic else 28

    def forward(self, x):
        act = torch.tanh if self.classic else F.relu
        pool = F.avg_pool2d if self.classic else F.max_pool2d
        x = pool(act(self.conv1(x)), 2)
        x = pool(act(self.conv2(x)), 2)
        x = torch.flatten(x, 1)
        x = act(self.fc1(x))
        x = act(self.fc2(x))
        return self.fc3(x)


def state_dict_numpy(model):
    """The state_dict as float32 numpy arrays (host copies)."""
    return {k: v.detach().cpu().numpy().astype(np.float32) for k, v in model.state_dict().items()}


def export_onnx(model, path, opset=17):
    """The legacy (TorchScript) exporter: plain Conv/Relu/MaxPool/Flatten/Gemm nodes,
    initializers named after the state_dict keys, a dynamic batch dimension."""
    model = model.eval()
    size = model.input_size
    device = next(model.parameters()).device
    dummy = torch.zeros(1, 1, size, size, device=device)
    torch.onnx.export(model, (dummy,), str(path), dynamo=False, opset_version=opset,
                      input_names=["input"], output_names=["logits"],
                      dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}},
                      do_constant_folding=True)


def load_state_dict_numpy(model, arrays):
    """``model.load_state_dict`` from numpy arrays (each reshaped to the torch parameter's shape)."""
    ref = model.state_dict()
    model.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(arrays[k]).reshape(ref[k].shape))
                           for k in ref})
    return model
