"""A small classifier, the original of the deliberately wrong migrations in test_verify.py."""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--lr", type=float, default=0.1)
parser.add_argument("--out", default="model.pt")
args = parser.parse_args()

torch.manual_seed(0)
x = torch.randn(96, 8)
y = (x[:, 0] + x[:, 1] > 0).long() + (x[:, 2] > 1).long()
x_test = torch.randn(51, 8)
y_test = (x_test[:, 0] + x_test[:, 1] > 0).long() + (x_test[:, 2] > 1).long()
train_loader = DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True)
test_loader = DataLoader(TensorDataset(x_test, y_test), batch_size=5)


class Net(nn.Module):
    def __init__(self):
        super(Net, self).__init__()
        self.fc1 = nn.Linear(8, 32)
        self.drop = nn.Dropout(0.2)
        self.fc2 = nn.Linear(32, 3)

    def forward(self, x):
        return self.fc2(self.drop(F.relu(self.fc1(x))))


model = Net().cuda()
optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

for epoch in range(args.epochs):
    model.train()
    total_loss = 0
    for data, target in train_loader:
        data, target = data.cuda(), target.cuda()
        optimizer.zero_grad()
        loss = F.cross_entropy(model(data), target)
        loss.backward()
        optimizer.step()
        total_loss += loss
    model.eval()
    test_loss = 0
    correct = 0
    seen = 0
    with torch.no_grad():
        for data, target in test_loader:
            data, target = data.cuda(), target.cuda()
            output = model(data)
            test_loss += F.cross_entropy(output, target, reduction="sum").item()
            correct += (output.argmax(1) == target).sum().item()
            seen += target.size(0)
    print("epoch {} train loss {:.4f} test loss {:.6f} accuracy {}/{}".format(
        epoch, total_loss / len(train_loader), test_loss / seen, correct, seen))
torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch}, args.out)
