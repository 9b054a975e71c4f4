"""Messages between ranks: the wire format (wire), authenticated ZeroMQ channels (channel), and
torch.distributed store and broadcast helpers (store). Import from the submodule you need."""
