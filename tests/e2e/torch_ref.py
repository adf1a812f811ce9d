"""PyTorch references for the end-to-end tests (torch_parity.py,
torch_checkpoint.py): the built-in networks as torch.nn.Modules with the
same parameter names as stoke's checkpoints, a safetensors reader/writer
(no safetensors package here), the training sampler of docs/loader.md, and
the input transform. Uses Debian's python3-torch (CPU)."""
import json, os, shutil, struct, subprocess, sys
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import stoke_test as t

FASHION = t.FASHION


# ---- the models (trainer/spec.c's built-ins) -------------------------------

class CNN(nn.Module):
    """PyTorch's DDP tutorial network, as stoke's built-in "cnn"."""

    def __init__(self, classes=10, dropout=True):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3)
        self.conv2 = nn.Conv2d(32, 64, 3)
        self.fc1 = nn.Linear(1600, 500)
        self.fc2 = nn.Linear(500, classes)
        self.dropout = dropout

    def forward(self, x):
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = self.conv2(x)
        if self.dropout:
            x = F.dropout2d(x, 0.5, self.training)
        x = F.relu(F.max_pool2d(x, 2))
        x = F.relu(self.fc1(torch.flatten(x, 1)))
        if self.dropout:
            x = F.dropout(x, 0.5, self.training)
        return self.fc2(x)


class MLP(nn.Module):
    """stoke's built-in "mlp": 784 -> 256 -> 128 -> classes."""

    def __init__(self, classes=10, dropout=True):
        super().__init__()
        self.fc1 = nn.Linear(784, 256)
        self.fc2 = nn.Linear(256, 128)
        self.fc3 = nn.Linear(128, classes)

    def forward(self, x):
        x = torch.flatten(x, 1)
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


class BasicBlock(nn.Module):
    """torchvision's BasicBlock: conv3x3 (stride) - bn - relu - conv3x3 - bn,
    plus the input, or its 1x1 projection with stride when the shape changes
    (downsample.0 conv, downsample.1 bn), then relu."""

    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                            nn.BatchNorm2d(cout))

    def forward(self, x):
        out = self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x)))))
        return F.relu(out + (x if self.downsample is None else self.downsample(x)))


class ResNet(nn.Module):
    """A CIFAR-style ResNet: 3x3 stem (conv1, bn1, relu; no max-pool), one
    stage per width (layer1, layer2, ...: `blocks` BasicBlocks, the first of
    every stage after the first with stride 2), global average pool, fc."""

    def __init__(self, widths, blocks, classes=10, channels=1):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, widths[0], 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(widths[0])
        cin = widths[0]
        for i, w in enumerate(widths):
            stage = []
            for b in range(blocks):
                stage.append(BasicBlock(cin, w, 2 if i > 0 and b == 0 else 1))
                cin = w
            setattr(self, f"layer{i + 1}", nn.Sequential(*stage))
        self.stages = len(widths)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        for i in range(self.stages):
            x = getattr(self, f"layer{i + 1}")(x)
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def resnet20(classes=10, channels=1, dropout=True):
    """He et al.'s CIFAR ResNet-20, as stoke's built-in "resnet20"."""
    return ResNet((16, 32, 64), 3, classes, channels)


def resnet18(classes=10, channels=1, dropout=True):
    """The CIFAR variant of ResNet-18, as stoke's built-in "resnet18"."""
    return ResNet((64, 128, 256, 512), 2, classes, channels)


MODELS = {"cnn": CNN, "mlp": MLP, "resnet20": resnet20, "resnet18": resnet18}


# ---- safetensors (F32; I64 for num_batches_tracked) --------------------------

def save_safetensors(path, tensors, metadata=None):
    """tensors: {name: torch or numpy array}; stoke_test.save_safetensors."""
    t.save_safetensors(path, {k: v.detach().cpu().numpy() if torch.is_tensor(v) else v
                              for k, v in tensors.items()}, metadata)


def load_safetensors(path):
    """{name: torch tensor (float32, or int64 for I64)} and the metadata dict."""
    arrays, meta = t.load_safetensors(path)
    return {k: torch.from_numpy(a.copy()) for k, a in arrays.items()}, meta


# ---- data -----------------------------------------------------------------------

permutation = t.permutation  # the training order of docs/loader.md


def fresh_subset_db(ntrain, ntest):
    """Empties the test's STK_TMP, makes it the working directory and
    writes "db" there: the first ntrain and ntest Fashion-MNIST samples
    (fm_subset.py, then prep)."""
    tmp = os.environ["STK_TMP"]
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    os.chdir(tmp)
    subprocess.run([sys.executable, os.path.join(os.environ["STK_SRC"], "tests/e2e/fm_subset.py"),
                    FASHION, "raw", str(ntrain), str(ntest)], check=True)
    subprocess.run([os.path.join(os.environ["STK_BIN"], "prep"), "--quiet", "raw", "db"],
                   check=True)


def make_db(path):
    """A Fashion-MNIST stoke database at path (reused when complete)."""
    if not is_complete(path):
        shutil.rmtree(path, ignore_errors=True)
        subprocess.run([os.path.join(os.environ["STK_BIN"], "prep"), "--quiet",
                        FASHION, path], check=True)
    return path


def is_complete(path):
    """Whether the documented reader accepts path."""
    try:
        t.formats_reader()["open_stoke"](path)
        return True
    except Exception:
        return False


def load_split(db, split):
    """(uint8 images [N, C, H, W], int64 labels [N], meta) of a split, read
    with the documented Python reader (one transaction, cursor order)."""
    r = t.formats_reader()
    env, meta = r["open_stoke"](db)
    c, h, w = meta["record"]["shape"]
    count = meta["splits"][split]["count"]
    x = np.empty((count, c, h, w), np.uint8)
    y = np.empty(count, np.int64)
    with env.begin(db=env.open_db(split.encode())) as txn:
        for i, (k, v) in enumerate(txn.cursor()):
            assert struct.unpack(">Q", k)[0] == i
            label, n = struct.unpack_from("<iI", v, 0)
            assert n == c * h * w and len(v) == 8 + n
            y[i] = label
            x[i] = np.frombuffer(v, np.uint8, n, 8).reshape(c, h, w)
    assert i == count - 1
    return x, y, meta


def normalizer(meta):
    """x uint8 [N, C, H, W] -> float32 tensor, as stoke's transform:
    (pixel / 255 - mean[c]) * (1 / std[c]) in float32, from the train
    split's statistics."""
    st = meta["splits"]["train"]
    mean = np.array(st["mean"], np.float32).reshape(1, -1, 1, 1)
    inv = (np.float32(1) / np.array([s if s > 0 else 1 for s in st["std"]],
                                    np.float32)).reshape(1, -1, 1, 1)

    def f(x):
        v = x.astype(np.float32) / np.float32(255)
        return torch.from_numpy(((v - mean) * inv).astype(np.float32))
    return f


def metrics(run_dir):
    return [json.loads(l) for l in open(os.path.join(run_dir, "metrics.jsonl"))]


def train(db, out, *args):
    """Runs stoke's train into a fresh out; returns its metrics lines."""
    shutil.rmtree(out, ignore_errors=True)
    cmd = [os.path.join(os.environ["STK_BIN"], "train"), "--db", db,
           "--out", out, "--quiet", *map(str, args)]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode:
        raise SystemExit(f"FAIL: {' '.join(cmd)} exited {p.returncode}:\n{p.stdout}{p.stderr}")
    return metrics(out)
