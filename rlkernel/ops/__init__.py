"""The public op functions: shape checks and dispatch only (numerics live in backends/, orders in contracts/)."""
