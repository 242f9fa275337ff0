"""The tasks the CPU configs train, each a dataset and its reward: toy (the default), long
responses, the tool-using agent, and code run in the sandbox."""
