//! End-to-end: the real `skiff` binary, a real gateway process, real git repositories, and a
//! scripted model (the only stand-in).

mod api;
mod bad_input;
mod harness;
mod session;
