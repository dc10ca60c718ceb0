//! The agent loop and its tools, against a real temporary workspace, a scripted in-memory
//! model client and an in-memory backend.

mod tools;
mod turn;
