"""Messages between ranks: the wire format (wire), authenticated ZeroMQ channels (channel), and
torch.distributed store and broadcast helpers (store), CUDA IPC handles (cuda_ipc), and the trainer ->
rollout weight sync (weights). Import from the submodule you need."""
