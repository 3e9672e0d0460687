"""Engine internals: step loop, scheduler, block manager, sequences, model runner."""
