"""The small MLP (128 -> 512 -> 512 -> 10, SGD with momentum) the offload fault and
reference-cycle tests train under the poison backend: one definition, so a test that compares
against another's figures trains the same model on the same batches."""


def mlp_and_step(torch):
    """``(model, step)``: the model seeded as every such test seeds it, and a training step on
    the next batch of its own generator (returns nothing)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 512), torch.nn.ReLU(),
                                torch.nn.Linear(512, 512), torch.nn.ReLU(),
                                torch.nn.Linear(512, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(1)

    def step():
        x = torch.randn(128, 128, generator=g)
        torch.nn.functional.cross_entropy(model(x), x[:, :10].argmax(1)).backward()
        opt.step()
        opt.zero_grad()
    return model, step
