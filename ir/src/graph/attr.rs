//! Attribute values as written in the text syntax.
//!
//! Known ops turn their attributes into typed fields (see [`crate::graph::op`]); this module holds
//! the untyped form that the frontend produces, that opaque ops keep, and that the printer
//! writes.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::graph::Graph;
use crate::tensor::Tensor;
use crate::types::Type;

/// The kind of an attribute (`AttributeProto.AttributeType`), as named in the text syntax.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum AttrKind {
    /// `int`
    Int,
    /// `float`
    Float,
    /// `string`
    String,
    /// `tensor`
    Tensor,
    /// `graph`
    Graph,
    /// `sparse_tensor`
    SparseTensor,
    /// `type_proto`
    TypeProto,
    /// `ints`
    Ints,
    /// `floats`
    Floats,
    /// `strings`
    Strings,
    /// `tensors`
    Tensors,
    /// `graphs`
    Graphs,
    /// `sparse_tensors`
    SparseTensors,
    /// `type_protos`
    TypeProtos,
}

impl AttrKind {
    /// Every kind.
    pub const ALL: &'static [AttrKind] = &[
        AttrKind::Int,
        AttrKind::Float,
        AttrKind::String,
        AttrKind::Tensor,
        AttrKind::Graph,
        AttrKind::SparseTensor,
        AttrKind::TypeProto,
        AttrKind::Ints,
        AttrKind::Floats,
        AttrKind::Strings,
        AttrKind::Tensors,
        AttrKind::Graphs,
        AttrKind::SparseTensors,
        AttrKind::TypeProtos,
    ];

    /// The keyword of the text syntax.
    pub fn name(self) -> &'static str {
        match self {
            AttrKind::Int => "int",
            AttrKind::Float => "float",
            AttrKind::String => "string",
            AttrKind::Tensor => "tensor",
            AttrKind::Graph => "graph",
            AttrKind::SparseTensor => "sparse_tensor",
            AttrKind::TypeProto => "type_proto",
            AttrKind::Ints => "ints",
            AttrKind::Floats => "floats",
            AttrKind::Strings => "strings",
            AttrKind::Tensors => "tensors",
            AttrKind::Graphs => "graphs",
            AttrKind::SparseTensors => "sparse_tensors",
            AttrKind::TypeProtos => "type_protos",
        }
    }

    /// Looks up a keyword of the text syntax.
    pub fn from_name(s: &str) -> Option<AttrKind> {
        AttrKind::ALL.iter().copied().find(|k| k.name() == s)
    }

    /// The list kind whose elements are of this kind (`int` → `ints`).
    pub fn list_of(self) -> Option<AttrKind> {
        Some(match self {
            AttrKind::Int => AttrKind::Ints,
            AttrKind::Float => AttrKind::Floats,
            AttrKind::String => AttrKind::Strings,
            AttrKind::Tensor => AttrKind::Tensors,
            AttrKind::Graph => AttrKind::Graphs,
            AttrKind::SparseTensor => AttrKind::SparseTensors,
            AttrKind::TypeProto => AttrKind::TypeProtos,
            _ => return None,
        })
    }

    /// The element kind of a list kind (`ints` → `int`).
    pub fn element(self) -> Option<AttrKind> {
        AttrKind::ALL.iter().copied().find(|k| k.list_of() == Some(self))
    }
}

impl fmt::Display for AttrKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// An attribute value.
#[derive(Clone, Debug, PartialEq)]
pub enum AttrValue {
    /// `int`
    Int(i64),
    /// `float`
    Float(f32),
    /// `string`
    String(String),
    /// `tensor`
    Tensor(Tensor),
    /// `graph`
    Graph(Box<Graph>),
    /// `type_proto`
    TypeProto(Type),
    /// `ints`
    Ints(Vec<i64>),
    /// `floats`
    Floats(Vec<f32>),
    /// `strings`
    Strings(Vec<String>),
    /// `tensors`
    Tensors(Vec<Tensor>),
    /// `graphs`
    Graphs(Vec<Graph>),
    /// `type_protos`
    TypeProtos(Vec<Type>),
    /// `@name`: a reference to an attribute of the enclosing function, of the given kind.
    Ref(AttrKind, String),
}

impl AttrValue {
    /// The same value, floats compared bit for bit and subgraphs structurally.
    pub fn same(&self, other: &AttrValue) -> bool {
        let floats =
            |a: &[f32], b: &[f32]| a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
        match (self, other) {
            (AttrValue::Float(a), AttrValue::Float(b)) => a.to_bits() == b.to_bits(),
            (AttrValue::Floats(a), AttrValue::Floats(b)) => floats(a, b),
            (AttrValue::Tensor(a), AttrValue::Tensor(b)) => a.same(b),
            (AttrValue::Tensors(a), AttrValue::Tensors(b)) => {
                a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.same(y))
            }
            (AttrValue::Graph(a), AttrValue::Graph(b)) => a == b,
            (AttrValue::Graphs(a), AttrValue::Graphs(b)) => a == b,
            (a, b) => a == b,
        }
    }

    /// The kind of this value.
    pub fn kind(&self) -> AttrKind {
        match self {
            AttrValue::Int(_) => AttrKind::Int,
            AttrValue::Float(_) => AttrKind::Float,
            AttrValue::String(_) => AttrKind::String,
            AttrValue::Tensor(_) => AttrKind::Tensor,
            AttrValue::Graph(_) => AttrKind::Graph,
            AttrValue::TypeProto(_) => AttrKind::TypeProto,
            AttrValue::Ints(_) => AttrKind::Ints,
            AttrValue::Floats(_) => AttrKind::Floats,
            AttrValue::Strings(_) => AttrKind::Strings,
            AttrValue::Tensors(_) => AttrKind::Tensors,
            AttrValue::Graphs(_) => AttrKind::Graphs,
            AttrValue::TypeProtos(_) => AttrKind::TypeProtos,
            AttrValue::Ref(k, _) => *k,
        }
    }

    /// True for graph-valued attributes (which the printer writes after the inputs).
    pub fn has_subgraph(&self) -> bool {
        match self {
            AttrValue::Graph(_) => true,
            AttrValue::Graphs(g) => !g.is_empty(),
            _ => false,
        }
    }
}

/// A named attribute.
#[derive(Clone, Debug, PartialEq)]
pub struct Attribute {
    /// The attribute's name.
    pub name: String,
    /// Its value.
    pub value: AttrValue,
}

impl Attribute {
    /// A named attribute.
    pub fn new(name: impl Into<String>, value: AttrValue) -> Attribute {
        Attribute { name: name.into(), value }
    }
}

/// Conversion between a typed attribute field and an [`AttrValue`]; implemented for the
/// Rust types that op structs use (`i64`, `f32`, `String`, `Vec<…>`, [`Tensor`], [`Graph`]).
pub trait AttrField: Sized {
    /// The kind this field holds.
    const KIND: AttrKind;
    /// Takes the value out, or gives it back when it has another kind. An `int` is accepted
    /// where a `float` is expected (the text syntax writes `alpha: float = 1`).
    fn from_value(v: AttrValue) -> Result<Self, AttrValue>;
    /// The value to print.
    fn to_value(&self) -> AttrValue;
}

macro_rules! attr_field {
    ($t:ty, $kind:ident, $var:ident) => {
        impl AttrField for $t {
            const KIND: AttrKind = AttrKind::$kind;
            fn from_value(v: AttrValue) -> Result<Self, AttrValue> {
                match v {
                    AttrValue::$var(x) => Ok(x),
                    other => Err(other),
                }
            }
            fn to_value(&self) -> AttrValue {
                AttrValue::$var(self.clone())
            }
        }
    };
}

attr_field!(i64, Int, Int);
attr_field!(String, String, String);
attr_field!(Tensor, Tensor, Tensor);
attr_field!(Type, TypeProto, TypeProto);
attr_field!(Vec<i64>, Ints, Ints);
attr_field!(Vec<String>, Strings, Strings);
attr_field!(Vec<Tensor>, Tensors, Tensors);
attr_field!(Vec<Graph>, Graphs, Graphs);

impl AttrField for f32 {
    const KIND: AttrKind = AttrKind::Float;
    fn from_value(v: AttrValue) -> Result<Self, AttrValue> {
        match v {
            AttrValue::Float(x) => Ok(x),
            AttrValue::Int(i) => Ok(i as f32),
            other => Err(other),
        }
    }
    fn to_value(&self) -> AttrValue {
        AttrValue::Float(*self)
    }
}

impl AttrField for Vec<f32> {
    const KIND: AttrKind = AttrKind::Floats;
    fn from_value(v: AttrValue) -> Result<Self, AttrValue> {
        match v {
            AttrValue::Floats(x) => Ok(x),
            AttrValue::Ints(i) => Ok(i.into_iter().map(|x| x as f32).collect()),
            other => Err(other),
        }
    }
    fn to_value(&self) -> AttrValue {
        AttrValue::Floats(self.clone())
    }
}

impl AttrField for Box<Graph> {
    const KIND: AttrKind = AttrKind::Graph;
    fn from_value(v: AttrValue) -> Result<Self, AttrValue> {
        match v {
            AttrValue::Graph(g) => Ok(g),
            other => Err(other),
        }
    }
    fn to_value(&self) -> AttrValue {
        AttrValue::Graph(self.clone())
    }
}
