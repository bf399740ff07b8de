//! zerotrain's runner: the agent that executes assigned ranks, and the sharded mixed-precision
//! GPT trainer (model, ZeRO engine, precision and loss scaling, optimizers, data, checkpoints).
//! The trainer arrives with the trainer issue; this crate is its home in the workspace.
