"""A DP training script written the way Opacus's tutorials write one (CNN on the sklearn
digits, Poisson sampling, make_private_with_epsilon at epsilon = 3).

tests/test_opacus_compat.py and bench/bench_opacus.py run it twice: as it is, on Opacus, and
with its three ``from opacus ...`` import lines replaced by
``from opake_compile.opacus import BatchMemoryManager, ModuleValidator, PrivacyEngine``. Nothing
else changes; ``ENGINE_KWARGS`` (empty here) lets a test pick opake_compile's cheap
``backend="aot_eager"``.
"""

import numpy as np
import torch
import torch.nn as nn
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader, TensorDataset

from opacus import PrivacyEngine
from opacus.utils.batch_memory_manager import BatchMemoryManager
from opacus.validators import ModuleValidator

ENGINE_KWARGS = {}
EPSILON = 3.0
DELTA = 1e-5
MAX_GRAD_NORM = 1.0


def load_data():
    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    perm = np.random.RandomState(0).permutation(len(y))  # the same split for every seed
    train, test = perm[:1437], perm[1437:]
    return TensorDataset(x[train], y[train]), TensorDataset(x[test], y[test])


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(16)  # ModuleValidator.fix replaces it with GroupNorm
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1, stride=2)
        self.fc = nn.Linear(32 * 4 * 4, 10)

    def forward(self, x):
        x = torch.tanh(self.bn1(self.conv1(x)))
        x = torch.tanh(self.conv2(x))
        return self.fc(x.flatten(1))


def train(seed=0, epochs=6, batch_size=64, lr=0.5, grad_sample_mode="hooks", max_physical_batch_size=None, accountant="prv"):
    torch.manual_seed(seed)
    train_set, test_set = load_data()
    train_loader = DataLoader(train_set, batch_size=batch_size)
    model = Net()
    errors = ModuleValidator.validate(model, strict=False)
    assert errors, "BatchNorm must be reported"
    model = ModuleValidator.fix(model)
    assert not ModuleValidator.validate(model, strict=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.5)
    criterion = nn.CrossEntropyLoss()

    privacy_engine = PrivacyEngine(accountant=accountant, **ENGINE_KWARGS)
    if grad_sample_mode == "ghost":
        model, optimizer, criterion, train_loader = privacy_engine.make_private_with_epsilon(
            module=model, optimizer=optimizer, criterion=criterion, data_loader=train_loader,
            target_epsilon=EPSILON, target_delta=DELTA, epochs=epochs,
            max_grad_norm=MAX_GRAD_NORM, grad_sample_mode="ghost",
        )
    else:
        model, optimizer, train_loader = privacy_engine.make_private_with_epsilon(
            module=model, optimizer=optimizer, data_loader=train_loader,
            target_epsilon=EPSILON, target_delta=DELTA, epochs=epochs,
            max_grad_norm=MAX_GRAD_NORM,
        )

    losses = []
    for epoch in range(epochs):
        model.train()
        with BatchMemoryManager(
            data_loader=train_loader,
            max_physical_batch_size=max_physical_batch_size or 4 * batch_size,
            optimizer=optimizer,
        ) as memory_safe_loader:
            for images, target in memory_safe_loader:
                optimizer.zero_grad()
                output = model(images)
                loss = criterion(output, target)
                losses.append(loss.item())
                loss.backward()
                optimizer.step()

    model.eval()
    correct = 0
    with torch.no_grad():
        for images, target in DataLoader(test_set, batch_size=256):
            correct += (model(images).argmax(dim=1) == target).sum().item()
    return {
        "accuracy": correct / len(test_set),
        "sigma": optimizer.noise_multiplier,
        "epsilon": privacy_engine.get_epsilon(DELTA),
        "losses": losses,
    }
