//! The gateway's own tests: a gateway in the test process (`harness`), no binary, no root.

mod admission;
mod harness;
