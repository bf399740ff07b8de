//! zerotrain's runner: the agent that executes assigned ranks, and the sharded mixed-precision
//! trainer for GPT-2 and the Llama family (models, ZeRO engine, precision and loss scaling,
//! optimizers, data, checkpoints).

pub mod accounting;
pub mod agent;
pub mod checkpoint;
pub mod comm;
pub mod data;
pub mod device;
mod error;
mod gpt;
mod llama;
mod lora;
pub mod loss_scale;
pub mod lr_schedule;
mod model;
pub mod optimizer;
pub mod process;
pub mod state_tensor;
pub mod step_timers;
pub mod tensor_file;
pub mod train;
pub mod validation;
pub mod zero;

pub use error::Error;
