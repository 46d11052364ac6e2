"""The engine: requests, the scheduler, the model runner and the step loop."""
