"""The compiler's trace: every layer's node (op, shapes, attributes) against the reference layer's forward and
its constructor arguments, nested names, and each refusal with its message (the layer's name, the reason, the
shapes).  Written for the mutation run of the compiler's passes (tools/mutation.py compiler)."""
import numpy as np
import pytest

from cydnn import nn
from cydnn.compiler import passes
from cydnn.compiler.trace import SUPPORTED, Unsupported, slope, trace


def test_each_layer_becomes_its_node_with_the_reference_shapes_and_attributes():
    inner = nn.Sequential(nn.Conv2d(2, 3, (3, 2), stride=(2, 1), padding=(1, 0), rng=0), nn.LeakyReLU(0.3))
    model = nn.Sequential(inner, nn.BatchNorm2d(3, eps=1e-3, momentum=0.25),
                          nn.Sequential(nn.MaxPool2d(3, stride=2, padding=1), nn.AvgPool2d((2, 1), stride=(1, 2))),
                          nn.Tanh(), nn.GlobalAvgPool2d(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.25),
                          nn.Linear(3, 4, rng=0), nn.BatchNorm1d(4, eps=0.5, momentum=0.75), nn.Sigmoid(), nn.ReLU())
    nodes = trace(model, (2, 9, 8), 3)
    assert [(n.name, n.op) for n in nodes] == [
        ("0.0", "conv2d"), ("0.1", "leaky_relu"), ("1", "batch_norm"), ("2.0", "max_pool"), ("2.1", "avg_pool"),
        ("3", "tanh"), ("4", "global_avg_pool"), ("5", "global_avg_pool"), ("6", "flatten"), ("7", "dropout"),
        ("8", "linear"), ("9", "batch_norm"), ("10", "sigmoid"), ("11", "relu")]
    x = np.random.default_rng(0).standard_normal((3, 2, 9, 8)).astype(np.float32)
    model.eval()
    for node in nodes:
        assert node.in_shape == x.shape, node
        x = node.module(x)
        assert node.out_shape == x.shape and all(type(s) is int for s in node.out_shape), node
    attrs = [n.attrs for n in nodes]
    assert attrs[0] == {"stride": (2, 1), "padding": (1, 0)}
    assert attrs[1] == {} and slope(nodes[1].module) == pytest.approx(0.3)
    assert attrs[2] == {"eps": 1e-3, "momentum": 0.25} and type(attrs[2]["eps"]) is float
    assert attrs[3] == {"kernel": (3, 3), "stride": (2, 2), "padding": (1, 1)}
    assert attrs[4] == {"kernel": (2, 1), "stride": (1, 2), "padding": (0, 0)}
    hw = nodes[6].in_shape[2:]
    assert hw == (2, 2) and attrs[6] == {"kernel": hw, "stride": hw, "padding": (0, 0)}
    assert attrs[7] == {"kernel": (1, 1), "stride": (1, 1), "padding": (0, 0)}
    assert nodes[8].out_shape == (3, 3) and attrs[8] == {} and attrs[9] == {}
    assert attrs[11] == {"eps": 0.5, "momentum": 0.75} and type(attrs[11]["momentum"]) is float
    assert slope(nodes[12].module) == 0.0 and slope(nodes[13].module) == 0.0
    assert nodes[0].module is inner[0] and nodes[11].module is model[9]


def test_node_prints_its_name_op_shapes_and_attributes():
    node = trace(nn.Sequential(nn.MaxPool2d(2)), (1, 4, 4), 2)[0]
    assert str(node) == f"{'0':<14} {'max_pool':<16} {'(2, 1, 4, 4)':<20} -> (2, 1, 2, 2) kernel=(2, 2) " \
                        f"stride=(2, 2) padding=(0, 0)"


def _refused(model, shape, batch, match):
    with pytest.raises(Unsupported, match=match):
        trace(model, shape, batch)


def test_refusals_name_the_layer_and_the_reason():
    _refused(nn.Sequential(nn.Flatten(), nn.Conv2d(1, 2, 3)), (1, 4, 4), 2,
             r"^layer 1: Conv2d needs \(N, C, H, W\), got \(2, 16\)$")
    _refused(nn.Sequential(nn.Flatten(), nn.MaxPool2d(2)), (1, 4, 4), 2, r"^layer 1: MaxPool2d needs \(N, C, H, W\)")
    _refused(nn.Sequential(nn.Flatten(), nn.AvgPool2d(2)), (1, 4, 4), 2, r"^layer 1: AvgPool2d needs")
    _refused(nn.Sequential(nn.Flatten(), nn.GlobalAvgPool2d()), (1, 4, 4), 2, r"^layer 1: GlobalAvgPool2d needs")
    _refused(nn.Sequential(nn.Conv2d(3, 2, 3)), (1, 5, 5), 2, r"^layer 0: conv_forward: .*channel")
    _refused(nn.Sequential(nn.Conv2d(1, 2, 3, padding=1), nn.MaxPool2d(5)), (1, 4, 4), 1,
             r"^layer 1: max_pool_forward: kernel \(5, 5\)")
    _refused(nn.Sequential(nn.AvgPool2d(3, padding=2)), (1, 4, 4), 1, r"^layer 0: avg_pool_forward: .*padding")
    _refused(nn.Sequential(nn.Linear(4, 2)), (2, 2), 3,
             r"^layer 0: Linear\(4, 2\) cannot take input \(3, 2, 2\) \(it needs \(N, 4\); a Flatten before it\?\)$")
    _refused(nn.Sequential(nn.Linear(4, 2)), (5,), 3, r"cannot take input \(3, 5\)")
    _refused(nn.Sequential(nn.BatchNorm2d(3)), (4, 2, 2), 2, r"^layer 0: BatchNorm2d\(3\) cannot take input \(2, 4, 2, 2\)$")
    _refused(nn.Sequential(nn.BatchNorm1d(3)), (3, 2, 2), 2, r"^layer 0: BatchNorm1d\(3\) cannot take input")
    _refused(nn.Sequential(nn.BatchNorm2d(3, affine=False)), (3, 2, 2), 2,
             r"^layer 0: the compiler takes batch norm with affine=True and track_running_stats=True$")
    _refused(nn.Sequential(nn.BatchNorm2d(3, track_running_stats=False)), (3, 2, 2), 2, r"track_running_stats=True")
    _refused(nn.Sequential(nn.ReLU(), nn.BatchNorm1d(3, momentum=None)), (3,), 2,
             r"^layer 1: momentum=None \(a cumulative average\) needs the host's batch count every step; "
             r"the compiler takes a fixed momentum$")


def test_refusals_of_the_model_and_the_input():
    _refused(nn.ReLU(), (3,), 1, r"^the compiler takes an nn.Sequential, not ReLU$")

    class Own(nn.Sequential):
        def forward(self, x):
            return x
    _refused(Own(nn.ReLU()), (3,), 1, r"^Own overrides forward\(\): the compiler only knows Sequential's$")
    _refused(nn.Sequential(nn.ReLU()), (3, 0), 2, r"^input shape \(2, 3, 0\) must be positive$")
    _refused(nn.Sequential(nn.ReLU()), (3,), 0, r"^input shape \(0, 3\) must be positive$")
    trace(nn.Sequential(nn.ReLU()), (1,), 1)            # the smallest input is taken
    _refused(nn.Sequential(), (3,), 1, r"^the Sequential has no layers$")
    _refused(nn.Sequential(nn.Sequential()), (3,), 1, r"^the Sequential has no layers$")
    # a nested Sequential that overrides forward is a layer of its own, which the compiler does not take
    _refused(nn.Sequential(nn.ReLU(), Own(nn.ReLU())), (3,), 1, r"^layer 1 is a Own, which the compiler does not take "
             r"\(it takes AdaptiveAvgPool2d, AvgPool2d, BatchNorm1d, .*, Tanh\)$")


def test_a_layer_named_like_a_known_one_but_not_cydnns_is_refused():
    class ReLU(nn.Module):
        def forward(self, x):
            return -x
    ReLU.__module__ = "mypackage.layers"
    _refused(nn.Sequential(nn.Flatten(), ReLU()), (3,), 1, r"^layer 1 is a ReLU, which the compiler does not take")


def test_parameters_that_are_not_float32_are_refused():
    lin = nn.Linear(3, 2, rng=0)
    lin.bias.data = lin.bias.data.astype(np.float64)
    _refused(nn.Sequential(lin), (3,), 1, r"^layer 0 has float64 parameters; the compiler runs float32$")
    lin = nn.Linear(3, 2, bias=False, rng=0)            # a missing bias is no parameter to check
    assert trace(nn.Sequential(lin), (3,), 1)[0].out_shape == (1, 2)


def test_supported_table_and_fusion_table():
    assert sorted(SUPPORTED) == ["AdaptiveAvgPool2d", "AvgPool2d", "BatchNorm1d", "BatchNorm2d", "Conv2d", "Dropout",
                                 "Flatten", "GlobalAvgPool2d", "LeakyReLU", "Linear", "MaxPool2d", "ReLU", "Sigmoid",
                                 "Tanh"]
    assert passes.ACTIVATIONS == {"relu": 1, "tanh": 2, "sigmoid": 3, "leaky_relu": 4}
    assert passes.FUSE_AFTER == ("conv2d", "linear") and passes.ALIGN == 256


def test_fusion_log_and_groups():
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.ReLU(), nn.Tanh(), nn.BatchNorm2d(2),
                          nn.Sigmoid(), nn.Flatten(), nn.Linear(8, 2), nn.BatchNorm1d(2))
    nodes = trace(model, (1, 4, 4), 2)
    log = []
    groups = passes.fuse(nodes, log=log, training=False)
    assert [(g["node"].name, g["bn"] and g["bn"].name, g["act"] and g["act"].name) for g in groups] == [
        ("0", "1", "2"), ("3", None, None), ("4", None, "5"), ("6", None, None), ("7", "8", None)]
    assert log == ["fold: 1 (batch_norm, running statistics) into 0 (conv2d)",
                   "fuse: 0 (conv2d) + 2 (relu) -> bias_act epilogue",
                   "fuse: 4 (batch_norm) + 5 (sigmoid) -> activation in place",
                   "fold: 8 (batch_norm, running statistics) into 7 (linear)"]
    train = passes.fuse(nodes, training=True)
    assert [(g["node"].name, g["bn"], g["act"] and g["act"].name) for g in train] == [
        ("0", None, None), ("1", None, "2"), ("3", None, None), ("4", None, "5"), ("6", None, None),
        ("7", None, None), ("8", None, None)]
    default = passes.fuse(nodes)                        # training is the default: nothing folded
    assert [(g["node"].name, g["bn"], g["act"] and g["act"].name) for g in default] == \
        [(g["node"].name, g["bn"], g["act"] and g["act"].name) for g in train]
    assert all(g["bn"] is None and g["act"] is None for g in passes.fuse(nodes, enabled=False, training=False))
    assert passes.fuse(nodes[:1], training=False)[0]["act"] is None      # a conv last: nothing after it


def test_slope_of_a_layer_without_keyword_arguments_is_zero():
    assert not hasattr(nn.Flatten(), "_kwargs") and slope(nn.Flatten()) == 0.0
    assert slope(nn.Linear(2, 2)) == 0.0 and slope(nn.LeakyReLU(0.125)) == 0.125


def test_global_pooling_of_a_non_square_plane_and_a_conv_bias_of_the_wrong_length():
    node = trace(nn.Sequential(nn.GlobalAvgPool2d()), (2, 3, 5), 1)[0]
    assert node.attrs == {"kernel": (3, 5), "stride": (3, 5), "padding": (0, 0)} and node.out_shape == (1, 2, 1, 1)
    conv = nn.Conv2d(1, 2, 3, rng=0)
    conv.bias.data = np.zeros(3, np.float32)            # the reference forward refuses it too
    _refused(nn.Sequential(conv), (1, 4, 4), 1, r"^layer 0: conv_forward: b has 3 entries but w has 2 output channels")
