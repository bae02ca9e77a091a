//! What the main job prints and drives beyond the library for the real model.
#![allow(dead_code)]

pub mod args;
pub mod real_model;
