"""One rank, one step of a model with a sparse embedding under the strategy given as JSON in argv[1]:
what ``hybridsync.DistributedOptimizer`` warns (tests/test_sparse_warning.py)."""
import json
import sys
import warnings

import horovod.torch as hvd
import torch
import torch.nn as nn

import hybridsync
from hybridsync.strategy import Strategy

hvd.init()
model = nn.Sequential(nn.Embedding(1000, 16, sparse=True), nn.Flatten(), nn.Linear(32, 1))
strategy = Strategy.from_dict(json.loads(sys.argv[1]))
opt = hybridsync.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                      named_parameters=model.named_parameters(), strategy=strategy)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for _ in range(2):
        opt.zero_grad()
        model(torch.randint(0, 1000, (8, 2))).sum().backward()
        opt.step()
print(json.dumps([str(w.message) for w in caught if "hybridsync" in str(w.message)]))
