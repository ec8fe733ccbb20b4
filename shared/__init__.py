"""What every specmesh role loads: configuration, protocol messages, Redis keys and the model code."""
