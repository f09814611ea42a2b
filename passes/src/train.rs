//! Training steps on the reference evaluator: runs a training graph (see
//! [`crate::autodiff`]) and carries its state — parameters, optimizer state, the step — from
//! one step to the next. The independent truth the runtime's training is checked against.

use std::collections::{BTreeMap, HashMap};

use ir::eval::Array;
use ir::{Graph, Op, Value};

use crate::autodiff::TrainInfo;

/// A training graph and its state.
#[derive(Clone, Debug)]
pub struct Trainer {
    /// The training graph; its initializers hold the current state.
    pub graph: Graph,
    /// Its interface.
    pub info: TrainInfo,
}

/// What one step reports.
#[derive(Clone, Debug)]
pub struct StepOut {
    /// The loss before the update.
    pub loss: f64,
    /// The gradient of every trainable initializer.
    pub gradients: BTreeMap<String, Array>,
}

impl Trainer {
    /// A trainer for training graph `graph`.
    pub fn new(graph: Graph) -> Result<Trainer, String> {
        let info = TrainInfo::of(&graph).ok_or("not a training graph: run the autodiff pass first")?;
        Ok(Trainer { graph, info })
    }

    /// Runs one step on `inputs` and applies the update.
    pub fn step(&mut self, inputs: &HashMap<String, Array>) -> Result<StepOut, String> {
        let outs = ir::eval::run(&self.graph, inputs, &Default::default()).map_err(|e| e.to_string())?;
        let loss = outs.first().ok_or("no loss")?.to_f64().map_err(|e| e.to_string())?[0];
        // The outputs move into the gradients and the next state.
        let names: Vec<String> =
            self.graph.outputs().iter().map(|o| self.graph.value_name(o.value).to_string()).collect();
        let mut by_name: HashMap<String, Array> = names.into_iter().zip(outs).collect();
        let mut gradients = BTreeMap::new();
        for (p, gname) in &self.info.gradients {
            gradients.insert(p.clone(), by_name.remove(gname).ok_or("a gradient output is missing")?);
        }
        let updates: Vec<(String, Array)> = self
            .info
            .state
            .iter()
            .map(|(s, next)| Ok((s.clone(), by_name.remove(next).ok_or("a state output is missing")?)))
            .collect::<Result<_, String>>()?;
        for (s, a) in updates {
            self.set_owned(&s, a)?;
        }
        Ok(StepOut { loss, gradients })
    }

    /// The loss at the current state, without a step.
    pub fn loss(&self, inputs: &HashMap<String, Array>) -> Result<f64, String> {
        let outs = ir::eval::run(&self.graph, inputs, &Default::default()).map_err(|e| e.to_string())?;
        Ok(outs.first().ok_or("no loss")?.to_f64().map_err(|e| e.to_string())?[0])
    }

    /// The current value of initializer `name`.
    pub fn get(&self, name: &str) -> Option<Array> {
        let v = self.graph.lookup(name)?;
        self.graph.initializer(v).and_then(|t| Array::from_tensor(t).ok())
    }

    /// Sets initializer `name`.
    pub fn set(&mut self, name: &str, a: &Array) -> Result<(), String> {
        self.set_owned(name, a.clone())
    }

    /// [`Trainer::set`], taking the array.
    fn set_owned(&mut self, name: &str, a: Array) -> Result<(), String> {
        let v: Value = self.graph.lookup(name).ok_or_else(|| format!("no initializer `{name}`"))?;
        if self.graph.initializer(v).is_none() {
            return Err(format!("`{name}` is not an initializer"));
        }
        self.graph.set_op(v.node, Op::Initializer(a.into_tensor()));
        Ok(())
    }
}
